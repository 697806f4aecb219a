"""The hook worker (``spool worker --kind hooks``): webhook deliveries, no torch (docs/webhooks.md)."""
