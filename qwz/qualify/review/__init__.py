"""Reading records: the report of one record, the comparison of two, the history of many; and
writing a run's files (run_files, outputs)."""
