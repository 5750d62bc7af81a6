"""The models the project builds and hands on: the offline tiny model (`tiny`), its warm start on environment text
(`warmstart`), a run's export with LoRA merged (`export`) and its model card (`model_card`)."""
