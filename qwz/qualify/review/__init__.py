"""Reading records: the report of one record, the comparison of two, the history of many."""
