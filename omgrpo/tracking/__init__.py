"""Where runs go: the local run store, the trackers (MLflow, W&B) behind one protocol, and sync."""
