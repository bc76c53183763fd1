//! The response headers that name the policy which served a request.

/// Response header carrying the policy version (of the tenant's adapter when one served the request).
pub const VERSION_HEADER: &str = "x-policy-version";

/// Response header naming the tenant whose adapter served the request; absent when the shared policy
/// served it.
pub const POLICY_TENANT_HEADER: &str = "x-policy-tenant";
