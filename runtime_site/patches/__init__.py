"""Patches to libraries, each guarded by the library version it was written against."""
