"""Thin command modules: parse -> config -> launch or call library code."""
