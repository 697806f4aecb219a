"""The ``spool`` console script."""
