"""Running a job: the training loop and what it runs beside the steps (the NaN guard's host side, the watchdog), the multi-process join, generation."""
