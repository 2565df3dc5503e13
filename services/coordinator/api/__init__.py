"""The control plane's API: the REST routes and the dashboard (`routes`), the read model every
GET answers from (`read_model`) and the request and response bodies (`schemas`)."""
