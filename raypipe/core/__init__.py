"""Core logic: numpy + pyarrow only. Importing anything here never imports ray or torch."""
