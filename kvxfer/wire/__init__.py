"""The wire both ends read alike: protobuf mappings, and the framing and limits of the lane and the
descriptor socket. The client (``kvxfer.client``) and the daemon (``service``) import it; it imports neither."""
