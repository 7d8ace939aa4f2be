"""Transports: they frame bytes and hand whole messages to the dispatcher."""
