"""The admin API and the read-only info routes about the workers."""
