"""Cluster layer: message contract, router core and its Ray actor."""
