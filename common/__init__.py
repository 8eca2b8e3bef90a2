"""Leaf package: small pure helpers every app and edge may use. No models, no app imports."""
