//! A judge endpoint that fails, hangs and returns garbage.
