//! Keys → effects. Pure: the loop reads a key, asks for its [`Effect`] and
//! hands that to [`crate::App::apply`].
//!
//! | key | effect |
//! |---|---|
//! | `q`, `Esc`, `Ctrl-C` | quit (stops the observation if it still runs) |
//! | `1`…`5`, `Tab`/`Shift-Tab`, `→`/`←` | views |
//! | `p`, `Space` | pause / resume |
//! | `r` | heatmap: residency / explicit reads |
//! | `↑`/`k`, `↓`/`j`, `PgUp`, `PgDn`, `Home`/`g`, `End`/`G` | scroll |

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

use crate::state::{Effect, Scroll, View};

/// One-line key help, shown at the bottom.
pub const HELP: &str = "q quit · 1-5 Tab ←→ views · p pause · ↑↓ PgUp PgDn Home End scroll";
/// The same for narrow terminals.
pub const HELP_SHORT: &str = "q quit · 1-5 views · p pause · ↑↓ scroll";

pub fn effect(key: KeyEvent) -> Option<Effect> {
    if key.kind == KeyEventKind::Release {
        return None;
    }
    let ctrl = key.modifiers.contains(KeyModifiers::CONTROL);
    Some(match key.code {
        KeyCode::Char('c') if ctrl => Effect::Quit,
        KeyCode::Char('q') | KeyCode::Esc => Effect::Quit,
        KeyCode::Char(c @ '1'..='5') => Effect::SwitchView(View::ALL[(c as u8 - b'1') as usize]),
        KeyCode::Tab | KeyCode::Right => Effect::NextView,
        KeyCode::BackTab | KeyCode::Left => Effect::PrevView,
        KeyCode::Char('p') | KeyCode::Char(' ') => Effect::TogglePause,
        KeyCode::Char('r') => Effect::NextHeatLayer,
        KeyCode::Char('f') => Effect::ToggleRefaultLayer,
        KeyCode::Up | KeyCode::Char('k') => Effect::Scroll(Scroll::Up(1)),
        KeyCode::Down | KeyCode::Char('j') => Effect::Scroll(Scroll::Down(1)),
        KeyCode::PageUp => Effect::Scroll(Scroll::PageUp),
        KeyCode::PageDown => Effect::Scroll(Scroll::PageDown),
        KeyCode::Home | KeyCode::Char('g') => Effect::Scroll(Scroll::Top),
        KeyCode::End | KeyCode::Char('G') => Effect::Scroll(Scroll::Bottom),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(code: KeyCode) -> KeyEvent {
        KeyEvent::new(code, KeyModifiers::NONE)
    }

    #[test]
    fn keys_map_to_effects() {
        assert_eq!(effect(k(KeyCode::Char('q'))), Some(Effect::Quit));
        assert_eq!(effect(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)), Some(Effect::Quit));
        assert_eq!(effect(k(KeyCode::Char('c'))), None);
        assert_eq!(effect(k(KeyCode::Char('3'))), Some(Effect::SwitchView(View::Heatmap)));
        assert_eq!(effect(k(KeyCode::Char('5'))), Some(Effect::SwitchView(View::Faults)));
        assert_eq!(effect(k(KeyCode::Char('6'))), None);
        assert_eq!(effect(k(KeyCode::Char(' '))), Some(Effect::TogglePause));
        assert_eq!(effect(k(KeyCode::Char('r'))), Some(Effect::NextHeatLayer));
        assert_eq!(effect(k(KeyCode::Char('f'))), Some(Effect::ToggleRefaultLayer));
        assert_eq!(effect(k(KeyCode::PageUp)), Some(Effect::Scroll(Scroll::PageUp)));
        assert_eq!(effect(k(KeyCode::Char('G'))), Some(Effect::Scroll(Scroll::Bottom)));
        let mut rel = k(KeyCode::Char('q'));
        rel.kind = KeyEventKind::Release;
        assert_eq!(effect(rel), None);
    }
}
