"""Request and response models of the REST API, one module per resource."""
