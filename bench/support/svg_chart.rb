# frozen_string_literal: true

module NeverBlockBench
  # Grouped bar charts as standalone SVG: panels stacked under a shared
  # legend, a group of bars per category (e.g. a server delay) and a bar per
  # series (e.g. a client), each panel a pivot of the result rows (the CSV's).
  # A String value (e.g. "failed") is drawn as text instead of a bar, nil as "n/a".
  class SvgChart
    PALETTE = %w[#4e79a7 #f28e2b #e15759 #76b7b2 #59a14f #b07aa1 #edc948 #9c755f].freeze
    WIDTH = 760
    PANEL_HEIGHT = 300
    LEFT = 72
    RIGHT = WIDTH - 16

    def initialize(title:, subtitle: nil)
      @title = title
      @subtitle = Array(subtitle)
      @pivots = []
    end

    # A panel of the rows given to {#write}: a group per value of column `by`
    # (one without it), a bar per value of column `series`, each the row's
    # `value` ("failed" when nil), of the rows matching `where`; `log`: a log y axis.
    def pivot(title, value, series:, by: nil, where: {}, log: false)
      @pivots << [title, value, series, by, where, log]
      self
    end

    # @return [String] path
    def write(path, rows)
      panels = @pivots.map do |title, value, series, by, where, log|
        mine = rows.select { |row| where.all? { |key, wanted| row[key] == wanted } }
        groups = mine.map { |row| row[by] }.uniq
        bars = mine.map { |row| row[series] }.uniq.to_h do |name|
          [name, groups.map { |group| mine.find { |row| row[series] == name && row[by] == group }.to_h[value] || "failed" }]
        end
        { title: title, categories: groups.map(&:to_s), series: bars, log: log }
      end
      File.write(path, to_svg(panels))
      path
    end

    # @param panels [Array<Hash>] :title, :categories, :series (name => a value per category), :log
    def to_svg(panels)
      names = panels.flat_map { |panel| panel[:series].keys }.uniq
      column = ((names.map(&:size).max || 1) * 6.6).ceil + 32 # swatch, gap, ~6.6 px per character
      columns = [(RIGHT - LEFT) / column, 1].max
      top = 36 + (@subtitle.size * 16)
      header = top + 10 + ((names.size.to_f / columns).ceil * 18)
      height = header + (panels.size * PANEL_HEIGHT) + 8
      body = [text(WIDTH / 2, 22, @title, size: 16, anchor: "middle", weight: "bold")]
      @subtitle.each_with_index { |line, i| body << text(WIDTH / 2, 40 + (i * 16), line, size: 11, anchor: "middle", fill: "#555555") }
      names.each_with_index do |name, i|
        x = LEFT + ((i % columns) * column)
        y = top + ((i / columns) * 18)
        body << %(<rect x="#{x}" y="#{y}" width="12" height="12" fill="#{PALETTE[i % PALETTE.size]}"/>) + text(x + 17, y + 10, name, size: 12)
      end
      panels.each_with_index { |panel, i| body << panel_svg(panel, names, header + (i * PANEL_HEIGHT)) }
      %(<svg xmlns="http://www.w3.org/2000/svg" width="#{WIDTH}" height="#{height}" viewBox="0 0 #{WIDTH} #{height}" ) +
        %(font-family="Helvetica, Arial, sans-serif">\n<rect width="100%" height="100%" fill="#ffffff"/>\n#{body.join("\n")}\n</svg>\n)
    end

    # "2360", "19.5", "0.42", "10": from 100 up and whole numbers as they are, else three significant digits.
    def self.format_number(value)
      return value.round.to_s if value.abs >= 100 || value == value.round

      format("%.#{[2 - Math.log10(value.abs).floor, 0].max}f", value)
    end

    private

    def panel_svg(panel, names, top)
      bottom = top + PANEL_HEIGHT - 44
      y, ticks = scale(panel[:series].values.flatten.grep(Numeric), panel[:log], bottom, top + 34)
      parts = [text(LEFT, top + 20, panel[:title] + (panel[:log] ? "; log scale" : ""), size: 13, weight: "bold")]
      ticks.each do |tick|
        at = y.call(tick).round(1)
        parts << %(<line x1="#{LEFT}" y1="#{at}" x2="#{RIGHT}" y2="#{at}" stroke="#e3e3e3"/>) +
                 text(LEFT - 6, at + 4, SvgChart.format_number(tick), size: 11, anchor: "end", fill: "#444444")
      end
      parts << %(<path d="M#{LEFT} #{top + 34}V#{bottom}H#{RIGHT}" stroke="#333333" fill="none"/>) # the axes
      group = (RIGHT - LEFT).to_f / panel[:categories].size
      width = (group * 0.8) / panel[:series].size
      panel[:categories].each_with_index do |category, c|
        left = LEFT + (c * group) + (group * 0.1)
        parts << text(left + (group * 0.4), bottom + 18, category, size: 12, anchor: "middle")
        panel[:series].each_with_index do |(name, series), s|
          parts << bar(series[c], left + (s * width), width, PALETTE[names.index(name) % PALETTE.size], y, bottom)
        end
      end
      parts.join("\n")
    end

    # @return [Array(Proc, Array<Float>)] value => pixel row, and the values that get a grid line:
    #   linear from 0 in steps of 1, 2, 2.5 or 5 × 10^n, or logarithmic by decades
    def scale(values, log, bottom, top)
      if log
        positive = values.select(&:positive?)
        low, high = Math.log10(positive.min || 1).floor.to_f, Math.log10(positive.max || 10).ceil.to_f # decades
        high += 1 if high <= low
        fraction = ->(v) { v <= 0 ? 0.0 : (Math.log10(v) - low) / (high - low) }
        ticks = (low.round..high.round).map { |power| 10.0**power }
      else
        rough = (values.max || 1).to_f / 5
        magnitude = rough.positive? ? 10.0**Math.log10(rough).floor : 1.0
        step = rough.positive? ? [1, 2, 2.5, 5, 10].map { |m| m * magnitude }.find { |s| s >= rough } : 1.0
        high = [(values.max.to_f / step).ceil, 1].max * step
        fraction = ->(v) { v / high }
        ticks = (0..(high / step).round).map { |i| i * step }
      end
      [->(v) { bottom - (fraction.call(v).clamp(0.0, 1.0) * (bottom - top)) }, ticks]
    end

    def bar(value, x, width, fill, y, bottom)
      center = (x + (width / 2)).round(1)
      return text(center, bottom - 4, value || "n/a", size: 9, anchor: "middle", fill: "#999999") unless value.is_a?(Numeric)

      top = y.call(value).round(1)
      label = SvgChart.format_number(value)
      rect = %(<rect x="#{(x + 1).round(1)}" y="#{top}" width="#{(width - 2).round(1)}" height="#{(bottom - top).round(1)}" ) +
             %(fill="#{fill}"><title>#{escape(label)}</title></rect>)
      # A bar too narrow for its value keeps it in its tooltip only.
      label.size * 5.6 <= width ? rect + text(center, top - 3, label, size: 9, anchor: "middle", fill: "#333333") : rect
    end

    def text(x, y, content, size:, anchor: "start", weight: "normal", fill: "#222222")
      %(<text x="#{x.round(1)}" y="#{y.round(1)}" font-size="#{size}" text-anchor="#{anchor}" ) +
        %(font-weight="#{weight}" fill="#{fill}">#{escape(content)}</text>)
    end

    def escape(content) = content.to_s.gsub("&", "&amp;").gsub("<", "&lt;").gsub(">", "&gt;").gsub('"', "&quot;")
  end
end
