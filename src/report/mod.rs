//! What the demo and the ablation reports share: PNG charts ([`chart`]) and markdown-table cells
//! ([`markdown`]). The reports themselves live with their commands (`demo::report`,
//! `ablate::report`); this module knows nothing of either.

pub mod chart;
pub mod markdown;

pub use chart::{check_finite, draw_panels, font_loaded, histogram, interval_chart, line_chart, IntervalItem, NamedSeries, Panel, FONT_PATHS};
pub use markdown::{cell, opt3};
