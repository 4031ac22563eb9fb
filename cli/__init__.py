"""The `digenrl` command line (installed as the `digenrl_cli` package)."""
