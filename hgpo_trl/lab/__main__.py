"""`python -m hgpo_trl.lab`: the estimator lab's command line (`hgpo_trl.lab.report.main`)."""

import sys

from hgpo_trl.lab.report import main

sys.exit(main())
