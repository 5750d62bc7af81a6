import sys

from hgpo_trl.lab.report import main

sys.exit(main())
