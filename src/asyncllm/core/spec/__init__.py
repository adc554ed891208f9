"""Speculative decoding's host side: drafters that propose a request's next tokens from plain data."""
