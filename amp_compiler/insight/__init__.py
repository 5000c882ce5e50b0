"""Seeing what a conversion did: explain, diff, render, compare, verify."""
