"""The studies: GMA (`training.studies.gma`), RFA (`training.studies.rfa`), membership inference."""
