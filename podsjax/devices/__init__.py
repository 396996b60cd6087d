"""Devices and compiled programs: meshes, hosts, TPU/GPU topologies, the compile cache, HLO costs, the plan."""
