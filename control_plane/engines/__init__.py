"""Engines: the engines the push endpoint heard from, as last seen."""
