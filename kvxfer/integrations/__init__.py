"""Backends that plug kvxfer into inference engines (each imports its engine; nothing else imports them)."""
