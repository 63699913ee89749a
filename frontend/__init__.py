"""The tokenizing frontend, the client library and its command line."""
