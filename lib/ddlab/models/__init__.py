"""Models for the labs: the materials MLP (lab 04) and the UNet (labs 06-07)."""
