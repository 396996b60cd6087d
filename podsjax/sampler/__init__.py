"""Generation: the Generator, its decode loop and its compiled programs."""
