"""Pure functions of a record: the contract a candidate is judged by (spec, contract, zeropp,
staging, wire, chunking), the record's schema, its seal and loading, the judge's rules (rules/:
one module per check family) and the checks derived with them (checks), the builder that turns
the ranks' observations into a record, statistics, provenance, the hash ledger and signing."""
