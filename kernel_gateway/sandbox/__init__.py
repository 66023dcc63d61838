"""The sandbox: profiles compiled to bwrap argv, and the launcher that applies them."""
