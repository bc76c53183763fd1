//! Hostile proxy requests.
