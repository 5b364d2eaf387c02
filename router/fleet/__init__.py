"""A vLLM engine twin (simulator) and the command lines of real vLLM engines for the fleet."""
