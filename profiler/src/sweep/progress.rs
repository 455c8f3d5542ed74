//! What a sweep shows while it runs: on a terminal a bar with elapsed time, ETA and the cells running
//! now, with one line per finished cell printed above it; elsewhere (a log file, CI) the lines alone.

use std::io::Write;
use std::time::Duration;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub struct Progress<'a> {
    bar: Option<ProgressBar>,
    log: &'a mut dyn Write,
}

impl<'a> Progress<'a> {
    /// A bar over `total` cells when `terminal`, drawn on stderr; lines to `log` otherwise.
    pub fn new(total: usize, terminal: bool, log: &'a mut dyn Write) -> Progress<'a> {
        let bar = terminal.then(|| {
            let style = ProgressStyle::with_template(
                "{bar:30} {pos}/{len} cells, {elapsed_precise} elapsed, ETA {eta_precise}  {wide_msg}",
            )
            .expect("a valid template");
            let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr()).with_style(style);
            bar.enable_steady_tick(Duration::from_millis(500));
            bar
        });
        Progress { bar, log }
    }

    /// A line that stays: above the bar, or in the log.
    pub fn line(&mut self, text: &str) -> Result<()> {
        match &self.bar {
            Some(bar) => bar.println(text),
            None => writeln!(self.log, "{text}")?,
        }
        Ok(())
    }

    /// One more cell finished.
    pub fn advance(&self) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    /// The cells running now, shown beside the bar.
    pub fn running(&self, cells: &[String]) {
        if let Some(bar) = &self.bar {
            bar.set_message(cells.join("; "));
        }
    }
}

impl Drop for Progress<'_> {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
