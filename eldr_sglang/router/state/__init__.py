"""The routing state and what changes it: the live routing and A/B arms, calibration online and from files, the decision log, admission."""
