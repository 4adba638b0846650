// The interactive dashboard: draws LayoutFrame screens with curses colours, redraws on every
// Watch frame and key press, and handles sort keys, resize and 'q'.
#pragma once

#include "tools/bgl-top/frame_layout.h"
#include "tools/bgl-top/history.h"
#include "tools/bgl-top/watch_feed.h"

namespace bgl::top {

// Runs until the user quits; returns the exit status.
int RunCursesUi(WatchFeed& feed, History& history, bagualu::v1::WatchResponse latest,
                LayoutOptions options);

}  // namespace bgl::top
