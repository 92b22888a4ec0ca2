"""User tools over finished outputs: convert, inspect, verify, pack-report, plot."""
