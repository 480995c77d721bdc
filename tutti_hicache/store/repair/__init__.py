"""Repair: attach healing (heal.py, its witness), re-homing pages of lost directories
(rehome.py) and the offline check (fsck.py)."""
