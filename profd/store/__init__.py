"""Durable state: the SQLite index, the spool and S3."""
