# frozen_string_literal: true

# bench/smuggling.rb's app, the same under every server: answers "ok" and
# appends a line per request it serves to the file NB_SMUGGLING_LOG names,
#
#   METHOD "TARGET" BODY_BYTES
#
# (the target path?query as String#dump writes it), so that the benchmark
# knows what each server served of each case.
log = ENV.fetch("NB_SMUGGLING_LOG")

run(lambda do |env|
  body = env["rack.input"]&.read.to_s
  query = env["QUERY_STRING"].to_s
  target = query.empty? ? env["PATH_INFO"] : "#{env['PATH_INFO']}?#{query}"
  File.write(log, "#{env['REQUEST_METHOD']} #{target.dump} #{body.bytesize}\n", mode: "a") # one write(2), O_APPEND
  [200, { "content-type" => "text/plain", "content-length" => "2" }, ["ok"]]
end)
