"""The PD request flow: named dispatch steps over their parts, and the relay shared by both flows."""
