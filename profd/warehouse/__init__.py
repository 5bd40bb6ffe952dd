"""The fleet warehouse: what every daemon knows as one open Parquet dataset on the shared
store (docs/warehouse.md). :mod:`.tables` holds the tables' schemas and the object layout."""
