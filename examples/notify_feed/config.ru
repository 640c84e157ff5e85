# frozen_string_literal: true

# A PostgreSQL LISTEN/NOTIFY feed served as server-sent events, by
# NeverBlock::Server: every open /events stream is a fiber waiting on a
# queue, one listener task per worker process waits on PostgreSQL, and a
# publish is one pooled query.
#
#   GET  /events   text/event-stream: `event: ready` once subscribed, then
#                  each notification on the channel as `data:` lines, and a
#                  `: heartbeat` comment after FEED_HEARTBEAT idle seconds
#   POST /publish  NOTIFYs the request body (UTF-8, at most 7999 bytes, else 413)
#   GET  /stats    this worker's clients, listener, messages queued, clients dropped (JSON)
#   GET  /         a page that shows the feed and publishes to it
#
# Run it from a checkout of NeverBlock, against any PostgreSQL:
#
#   DATABASE_URL=postgres://user:password@127.0.0.1/dbname \
#     bundle exec exe/neverblock serve examples/notify_feed/config.ru -p 9292 -w 2 --shutdown-timeout 2
#
# then open http://127.0.0.1:9292/ in a browser, or:
#
#   curl -N http://127.0.0.1:9292/events
#   curl --data-binary 'hello' http://127.0.0.1:9292/publish
#   psql "$DATABASE_URL" -c "NOTIFY feed, 'from psql'"
#
# Settings (environment): DATABASE_URL (required); FEED_CHANNEL (default
# feed); FEED_HEARTBEAT (seconds, default 15); FEED_QUEUE_LIMIT (messages
# a client may fall behind before it is dropped, default 100).
#
# Open streams end only when their clients leave: on a stop they are cut
# after --shutdown-timeout (30 s by default), and EventSource clients
# reconnect on their own.

require_relative "feed"

url = ENV.fetch("DATABASE_URL") do
  raise "examples/notify_feed: set DATABASE_URL, like postgres://user:password@127.0.0.1/dbname"
end
db = NeverBlock::Postgres.pool(url: url, size: 5)

run NotifyFeed::App.new(db: db, channel: ENV.fetch("FEED_CHANNEL", "feed"),
                        heartbeat: Float(ENV.fetch("FEED_HEARTBEAT", "15")),
                        queue_limit: Integer(ENV.fetch("FEED_QUEUE_LIMIT", "100")))
