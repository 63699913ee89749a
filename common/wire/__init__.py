"""wire: every message by link, their codec, channels and CURVE keys. Imports base."""
