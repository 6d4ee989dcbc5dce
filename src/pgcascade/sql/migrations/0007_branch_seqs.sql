-- pgcascade schema, migration 7: a branch lists in set_seq the sequences it follows.
--
-- Its subscribers may follow only sequences whose values it keeps itself: those it follows.
-- Branches installed earlier had set_seq empty until a takeover; fill it from what they follow.

insert into pgcascade.set_seq (queue_name, seq_name)
select s.queue_name, s.seq_name
  from pgcascade.subscriber_seq s
  join pgcascade.node n on n.queue_name = s.queue_name and n.node_type = 'branch'
on conflict do nothing;
