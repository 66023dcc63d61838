"""HTTP over Unix sockets: thin Tornado handlers over the plain-Python core."""
