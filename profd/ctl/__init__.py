"""profctl: the operator command line. One module per command under ``commands/``."""
