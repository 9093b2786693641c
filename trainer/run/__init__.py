"""Running a job: the training loop and its plug-ins, what it runs beside the steps (the NaN guard's host side:
on_nan.py; the watchdog, ...), the multi-process join, generation."""
