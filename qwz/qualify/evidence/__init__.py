"""Pure functions of a record: the spec a candidate is judged by, the record's schema, its seal
and loading, the checks derived from its observations, the builder that turns the ranks'
observations into a record, statistics, provenance, the hash ledger and signing."""
