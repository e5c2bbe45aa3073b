"""Text and tokens: reading text files, the on-disk token cache, calibration windows and the
training corpus. The built-in calibration sample (calibration_sample.txt) lives here too."""
