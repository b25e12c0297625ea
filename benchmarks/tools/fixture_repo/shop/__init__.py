"""A tiny shop."""

VERSION = "1.4.2"
