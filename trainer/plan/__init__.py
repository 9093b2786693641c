"""Planning without training (`meshtrain plan`: trainer/plan/command.py): per-device memory, communication and step
time, the layout search and the cluster simulator, on the device figures of trainer/hardware.py."""
