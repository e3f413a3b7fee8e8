"""The object-storage tier: S3 (and S3-compatible servers), GCS and Azure Blob through one client."""
